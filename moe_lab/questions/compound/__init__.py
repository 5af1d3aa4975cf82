"""Question 05: Do the gradients agree too, and how do differences grow over stacked layers?"""

from ..spec import Question
from .params import CompoundParams

QUESTION = Question(
    number="05",
    name="compound",
    text="Do the gradients agree too, and how do differences grow over stacked layers?",
    notebook="05_does_it_compound",
    package=__name__,
    runs=("experiment",),
    experiments=("compound",),
    findings=("findings",),
    answers={"gradients agree": "gradients", "fix: gradients": "gradients"},
    figures="figures",
    compare="compare",
    params=CompoundParams,
)
