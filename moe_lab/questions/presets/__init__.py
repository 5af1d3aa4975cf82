"""Question 07: Your model: do a production MoE layer's EP ranks agree, where do they part, and which setting fixes it
at what cost?"""

from ..spec import Question
from .params import PresetParams

QUESTION = Question(
    number="07",
    name="presets",
    text=("Your model: do a production MoE layer's EP ranks agree, where do they part, and which setting fixes "
          "it at what cost?"),
    notebook="07_your_model",
    package=__name__,
    runs=("experiment",),
    experiments=("presets",),
    findings=("findings",),
    answers={"ranks agree": "diverges", "first divergent stage": "where", "fix: ranks diverge": "fix"},
    figures="figures",
    compare="compare",
    params=PresetParams,
)
