"""Question 06: Trained under different layouts from the same weights on the same batches: how soon and how far do runs
part, is it the layout or run-to-run, and which setting keeps them bitwise equal?"""

from ..spec import Question
from .params import TrainParams

QUESTION = Question(
    number="06",
    name="training",
    text=("Trained under different layouts from the same weights on the same batches: how soon and how far do "
          "runs part, is it the layout or run-to-run, and which setting keeps them bitwise equal?"),
    notebook="06_does_it_matter_for_training",
    package=__name__,
    runs=("experiment",),
    experiments=("training",),
    findings=("findings",),
    answers={"layouts agree": "training", "layout vs run-to-run": "training", "fix: layouts": "training", "loss finite": "training"},
    figures="figures",
    compare="compare",
    params=TrainParams,
)
