"""What a scan writes into ``--out``: TensorBoard events, ``summary.json``, the HTML report."""
