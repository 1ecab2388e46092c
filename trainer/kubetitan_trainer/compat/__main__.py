"""``python -m kubetitan_trainer.compat [--write FILE]``: print the doc table, or write it into FILE."""

import argparse


def main() -> None:
    from kubetitan_trainer.compat import doc_table, write_doc

    p = argparse.ArgumentParser(prog="python -m kubetitan_trainer.compat", description="print or write the doc table")
    p.add_argument("--write", metavar="FILE", help="replace the table between the compat markers in FILE")
    a = p.parse_args()
    if a.write:
        print(f"{a.write}: {'updated' if write_doc(a.write) else 'unchanged'}")
    else:
        print(doc_table())


if __name__ == "__main__":
    main()
