"""A pairs file of another task than the built-in one, to try the seq2seq example's default config on.

    python -m benchmarks.date_pairs dates.tsv [--pairs 12000] [--seed 0]

Writes distinct dates between 1900 and 2099 as ``2019-03-07<TAB>7 March 2019``, drawn with ``--seed``.
"""

import argparse
import datetime
import random
from pathlib import Path


def date_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    first, days = datetime.date(1900, 1, 1), (datetime.date(2100, 1, 1) - datetime.date(1900, 1, 1)).days
    dates = [first + datetime.timedelta(days=offset) for offset in rng.sample(range(days), count)]
    return [(day.isoformat(), f"{day.day} {day:%B} {day.year}") for day in dates]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path)
    parser.add_argument("--pairs", type=int, default=12000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.output.write_text("".join(f"{s}\t{t}\n" for s, t in date_pairs(args.pairs, args.seed)), encoding="utf-8")
    print(f"wrote {args.pairs:,} pairs to {args.output}")


if __name__ == "__main__":
    main()
