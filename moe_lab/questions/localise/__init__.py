"""Question 02: Is it the probs all-gather: which stage and which collective first diverge across EP ranks?"""

from ..spec import Question

QUESTION = Question(
    number="02",
    name="localise",
    text="Is it the probs all-gather: which stage and which collective first diverge across EP ranks?",
    notebook="02_isolate_probs_allgather",
    package=__name__,
    runs=("experiment",),
    experiments=("localise",),
    findings=("findings",),
    answers={"first divergent stage": "where"},
    figures="figures",
    compare="compare",
)
