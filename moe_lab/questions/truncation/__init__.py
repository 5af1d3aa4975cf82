"""Question 04: Why does the truncation test fail, and which remedy keeps the first tokens bitwise invariant, at what
cost?"""

from ..spec import Question
from .params import TruncationParams

QUESTION = Question(
    number="04",
    name="truncation",
    text="Why does the truncation test fail, and which remedy keeps the first tokens bitwise invariant, at what cost?",
    notebook="04_truncation_test",
    package=__name__,
    runs=("experiment",),
    verdicts=("verdict",),
    experiments=("truncation",),
    findings=("findings",),
    answers={"truncation": "truncation", "fix: truncation": "truncation"},
    figures="figures",
    compare="compare",
    params=TruncationParams,
)
