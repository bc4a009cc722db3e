"""The coverage table of docs/supported_models.md, made from a full run's results.

    python scripts/coverage_table.py [results/cells.jsonl]           rewrite the table
    python scripts/coverage_table.py --check [results/cells.jsonl]   fail if it differs

Each line of the results is an engine a passing test ran (tests/e2e/cells.py): the test, and
what the engine ran (NPUWorker.summary). A row is an architecture with a quantization, a
parallel layout, a speculative method and vLLM's model runner (V1 unless the results say); a
column is the graph mode in effect; a cell names
the test modules whose passing tests ran it. `bash scripts/run_tests.sh` (the full tier) writes
the results and runs the check, so the table claims nothing the run did not prove and leaves
out nothing it did.
"""

import argparse
import collections
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "supported_models.md"
RESULTS = ROOT / "results" / "cells.jsonl"
BEGIN, END = "<!-- coverage table: generated -->", "<!-- end of the coverage table -->"
MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


def table(lines: list[str]) -> str:
    cells = collections.defaultdict(set)
    for line in lines:
        if line.strip():
            run = json.loads(line)
            row = (run["architecture"], run["quantization"], run["layout"],
                   run["speculative"] or "", run.get("model_runner", "V1"))
            module = run["test"].split("::")[0].rsplit("/", 1)[-1]
            cells[row, run["graph_mode"]].add(module.removeprefix("test_").removesuffix(".py"))
    rows = sorted({row for row, _ in cells})
    out = ["| architecture | quantization | layout | speculative | runner | " + " | ".join(MODES)
           + " |", "|---" * (5 + len(MODES)) + "|"]
    for row in rows:
        out.append("| " + " | ".join(row[:3] + (row[3] or "—", row[4])) + " | " + " | ".join(
            ", ".join(sorted(cells[row, mode])) or "—" for mode in MODES) + " |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="compare with the table in the docs instead of rewriting it")
    parser.add_argument("results", nargs="?", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--doc", type=pathlib.Path, default=DOC, help=argparse.SUPPRESS)
    args = parser.parse_args()
    made = table(args.results.read_text().splitlines())
    doc = args.doc.read_text()
    head, rest = doc.split(BEGIN, 1)
    current, tail = rest.split(END, 1)
    current = current.strip("\n")
    if not args.check:
        args.doc.write_text(head + BEGIN + "\n" + made + "\n" + END + tail)
        print(f"{args.doc}: {made.count(chr(10)) - 1} rows")
        return 0
    if current == made:
        print(f"{args.doc}: the coverage table is what this run proved")
        return 0
    old, new = set(current.splitlines()), set(made.splitlines())
    print(f"{args.doc}: the coverage table is not what this run proved "
          f"(results in {args.results}); `python scripts/coverage_table.py` rewrites it.",
          file=sys.stderr)
    for line in sorted(old - new):
        print("  in the docs, not proved:", line, file=sys.stderr)
    for line in sorted(new - old):
        print("  proved, not in the docs:", line, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
