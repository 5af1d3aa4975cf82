"""Question 01: Same tokens on every EP rank: do the outputs agree — EP order or run-to-run nondeterminism — and does
another layout of the same weights change the bits?"""

from ..spec import Question
from .params import LayoutParams

QUESTION = Question(
    number="01",
    name="reproduce",
    text=("Same tokens on every EP rank: do the outputs agree — EP order or run-to-run nondeterminism — and "
          "does another layout of the same weights change the bits?"),
    notebook="01_reproduce_ep_divergence",
    package=__name__,
    runs=("experiment", "layouts"),
    experiments=("reproduce", "layouts"),
    findings=("findings", "layouts_findings"),
    answers={"ranks agree": "diverges", "layout changes the bits": "diverges"},
    figures="figures",
    compare="compare",
    params=LayoutParams,
)
