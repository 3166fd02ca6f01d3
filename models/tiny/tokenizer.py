"""The tiny byte-level BPE tokenizer, trained in-process on Arith text and built-in LaTeX.

Byte-level, so any text (MATH problems included) round-trips; every digit is its own token (its
leading space attached) so numbers are spelled digit by digit; "\\n\\n" and the Math-Shepherd step
tag "ки" are single tokens, and pad and eos are distinct. Training is deterministic, so no
tokenizer file has to ship with the repository.
"""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from envs.datasets import Arith
from envs.prompts import SHEPHERD_STEP_TAG, format_prompt, join_steps, split_steps

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""GPT-2's split with two changes: one digit per piece (its leading space attached) and runs of
newlines kept whole, so "\\n\\n" before a word is one token as in Qwen's tokenizer."""

LATEX_SNIPPETS = (
    r"What is $\frac{1}{2} + \frac{1}{3}$? Express your answer as a common fraction.",
    r"Find all real $x$ such that $x^{2} - 5x + 6 = 0$. Enter all the solutions, separated by commas.",
    r"Simplify $\sqrt{50} + \sqrt{18}$ and write it as $a\sqrt{b}$.",
    r"The area of a circle is $49\pi$ square units. What is the radius, in units?",
    r"Compute $\dfrac{3}{4} \cdot \dfrac{8}{9}$ and $\tfrac{1}{2}$.",
    r"If $\left( \frac{a}{b} \right)^{2} = 4$ and $b \neq 0$, find $\left| a \right|$.",
    r"How many integers $n$ satisfy $-3 \leq n \leq 5$ and $n \geq 0$?",
    r"Let $f(x) = 3x^2 - 2x + 1$. Evaluate $f(-1)$.",
    r"In $\triangle ABC$, $\angle A = 90^\circ$ and $AB = 6$. Find $\sin B$, $\cos B$ and $\tan B$.",
    r"Evaluate $\log_{2} 64 - \log_{3} 27$.",
    r"What is $\binom{8}{3}$? What is $5!$?",
    r"Find $\lfloor 3.7 \rfloor + \lceil -1.2 \rceil$.",
    r"The vector $\mathbf{v} = \begin{pmatrix} 1 \\ -2 \end{pmatrix}$; find $\|\mathbf{v}\|$.",
    r"Solve $x \equiv 3 \pmod{7}$ for $0 \le x < 7$.",
    r"Compute $\sum_{k=1}^{n} k$ and $\prod_{k=1}^{4} k$ for $n = 10$.",
    r"The answer is $\boxed{\frac{\sqrt{3}}{2}}$, or $\boxed{2\pi}$, or $\boxed{\text{(A)}}$.",
    r"A shirt costs $\$20$ after a $25\%$ discount. What was the price, in dollars?",
    r"Let $S = \{1, 2, 3, \ldots, 10\}$ and $T \subseteq S$ with $T \cap \{1, 2\} = \emptyset$.",
    r"For $x \in \mathbb{R}$, $x \to \infty$, compare $e^{x}$ with $x^{10}$; also $\theta$, $\alpha$, $\beta$.",
    r"Express $0.\overline{36}$ as a fraction; find $\sqrt[3]{27} \times 2 \div 3 \pm 1$.",
    r"Points $A$, $B$ and $C$ lie on $\overline{AB}$; the midpoint is "
    r"$\left(\frac{x_1+x_2}{2}, \frac{y_1+y_2}{2}\right)$.",
    r"\begin{align*} x + y &= 10 \\ x - y &= 2 \end{align*} so $x = 6$ and $y = 4$; $\cdots$",
    r"The sequence $a_1, a_2, \dots$ has $a_{n+1} = 2a_n + 1$; find $a_{5}$ when $a_1 = 1$.",
    r"Find the remainder when $2^{100}$ is divided by $7$. \qquad \quad \, \! \;",
)
"""MATH-style text for the tokenizer's merges; built in so the build needs no data file."""


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE tokenizer (deterministic; trained once per process, then copied)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    arith_text = [format_prompt(p.problem) + join_steps(split_steps(p.solution))
                  for p in Arith().problems(2000, seed=0)]
    tokenizer.train_from_iterator(arith_text + list(LATEX_SNIPPETS) * 20, trainer)
    tokenizer.add_tokens([AddedToken(SHEPHERD_STEP_TAG, normalized=False)])
    return tokenizer.to_str()
