"""The seq2seq example's built-in corpus, used when ``data.path`` is unset: numbers (``"305,017"``) paired with their
English words, drawn from a seed.
"""

import random

ONES = [
    *("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"),
    *("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"),
]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
# Every character the built-in task can produce, so its vocabulary is known before any corpus exists.
BUILTIN_ALPHABET = sorted(set("".join(ONES + TENS) + "hundred thousand -,0123456789"))


def number_to_words(number: int) -> str:
    """``305017 -> "three hundred five thousand seventeen"`` (American English, no "and"), for 0..999,999."""

    def below_thousand(n: int) -> list[str]:
        words = [ONES[n // 100], "hundred"] if n >= 100 else []
        n %= 100
        if n >= 20:
            words.append(TENS[n // 10] + (f"-{ONES[n % 10]}" if n % 10 else ""))
        elif n:
            words.append(ONES[n])
        return words

    if number == 0:
        return "zero"
    thousands, rest = divmod(number, 1000)
    words = [*below_thousand(thousands), "thousand"] if thousands else []
    return " ".join(words + below_thousand(rest))


def builtin_pairs(num_pairs: int, max_digits: int, seed: int) -> list[tuple[str, str]]:
    """Distinct numbers with a uniformly drawn digit count, so short numbers are as common as the long ones allow,
    and one in four rounded (``12,000``), as people often write numbers. Sources have a comma before the
    thousands (``"305,017"``).
    """
    rng = random.Random(seed)
    numbers: dict[int, None] = {}  # a dict keeps the draw order, so the corpus is the same on every run
    while len(numbers) < num_pairs:
        digits = rng.randint(1, max_digits)
        number = rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)
        if rng.random() < 0.25:
            unit = 10 ** rng.randrange(digits)
            number = number // unit * unit
        numbers[number] = None
    return [(f"{n:,}", number_to_words(n)) for n in numbers]
