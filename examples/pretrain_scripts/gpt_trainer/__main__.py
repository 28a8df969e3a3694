"""``python -m gpt_trainer ...``: the example trainer with the mechmon monitors (see monitored.py)."""

import sys

from gpt_trainer.monitored import run

if __name__ == "__main__":
    sys.exit(run())
