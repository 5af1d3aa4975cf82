"""Question 09: does the divergence across EP ranks depend on the sequence length?"""

from ..spec import Question
from .params import SeqLenParams

QUESTION = Question(
    number="09",
    name="seq_len",
    text="Does the divergence across EP ranks depend on the sequence length (tokens per forward)?",
    notebook="09_does_it_depend_on_seq_len",
    package=__name__,
    runs=("experiment",),
    experiments=("seq_len",),
    findings=("findings",),
    figures="figures",
    compare="compare",
    params=SeqLenParams,
    axes=("seq_len",),
)
