"""Question 03: Which fp32/fp64 or deterministic setting makes the EP ranks agree, in which release, at what cost?"""

from ..spec import Question
from .params import PromotionParams

QUESTION = Question(
    number="03",
    name="promotion",
    text="Which fp32/fp64 or deterministic setting makes the EP ranks agree, in which release, at what cost?",
    notebook="03_precision_promotion",
    package=__name__,
    runs=("experiment",),
    experiments=("promotion",),
    findings=("findings",),
    answers={"fix: ranks diverge": "fix"},
    fallback_answers={"plain ranks agree": "diverges"},
    figures="figures",
    compare="compare",
    params=PromotionParams,
)
