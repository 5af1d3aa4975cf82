"""Question 08: is this gap expected? The same global weights and tokens run in bf16 under each layout and once in
fp64 (the truth: the same bf16 weights and tokens upcast, so only the arithmetic differs); each run's error to the
truth, per element in ULPs of the truth's bf16 value, judged against the bands of the known-correct runs
(`rule`)."""

from ..spec import Question
from .params import OracleParams

QUESTION = Question(
    number="08",
    name="oracle",
    text="Is this gap expected: is every layout's bf16 output as close to an fp64 truth as rounding lets it be, "
         "and what tolerance does a test of two layouts need?",
    notebook="08_is_this_gap_expected",
    package=__name__,
    runs=("experiment", "gradients", "trajectory"),
    experiments=("oracle", "oracle_gradients", "oracle_trajectory"),
    findings=("findings", "gradients_findings"),
    figures="figures",
    compare="compare",
    params=OracleParams,
    answers={"gap expected": "expected"},
)
