"""python -m reports RUN [RUN ...] [--out PNG] [--table | --sensitivity]: train.py --plot without
train.py, the figures and tables of finished runs (reports/report.py; docs/outputs.md, docs/paper.md
§8)."""
import sys

from reports.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m reports"))
