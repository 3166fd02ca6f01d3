"""Multi-agent workflows over one math problem: who speaks when, what each role reads, how the final
answer is taken. ``envs.multi_agent`` runs a ``Workflow`` as a gymnasium vector env.

- ``Role``: a name; how its prompt is built from the transcript so far; whether the trainer trains
  it; the message it stands in with for counterfactual credit (``default``); whether its message
  carries an answer to verify (``answers``) or a verdict on another role's answer (``judges``).
- ``Workflow``: its roles, one per agent slot (A slots); a schedule (which slots act at each turn,
  from what was said so far: several slots may act in one turn, as in a debate; none ends the
  episode); how the final answer is taken (``"last"``: the last answering message's answer;
  ``"vote"``: the majority over the answering messages of the last turn that had any, answers
  grouped by equivalence, a tie going to the group whose first answer sits in the lowest slot).

A transcript is the tuple of ``Message`` said so far, in turn order (slot order within a turn).
Everything here is a pure function of it; nothing grades. Answer equivalence comes in as a callable,
so the env can grade every comparison of one step in one time-bounded batch.

Prompts reuse the env's template (``envs.prompts``): the earlier messages, each under ``[role name]``,
and then the role's instruction come before the problem, as the template's context (in front of the
plain template's prompt; inside the user turn of a chat template, so every role reads one
conversation), so every prompt ends as the task's own prompts do, and a role with no instruction that
reads no earlier message gets exactly the single-agent prompt.

Verdicts (``Role.verdict_by``) come in two kinds:

- ``"line"``: a judging role ends its message with one final line ``Verdict: correct`` (accept) or
  ``Verdict: wrong`` (reject); case, surrounding spaces and a final period do not matter. Only the
  last ``MAX_VERDICT_CHARS`` characters are read, with an anchored regex: model output is untrusted.
- ``"solving"``: verification by solving again. The judging role writes its own solution, and it
  accepts exactly when its answer agrees with the judged one at the string level
  (``grader.strings_equiv``: normalised strings, plain numbers; pure, so the schedule can read it).
  Agreement is evidence of a right answer as far as the two solutions' errors are independent (one
  model solving twice shares many of them); answers that agree only symbolically (``\\sqrt{4}`` and
  ``2``) count as a disagreement, which costs a revision, not a wrong acceptance.

Anything else (no verdict line; no answer of its own) is unparseable and counts as a rejection (the
solution was not vouched for).

Built-ins (functions that return a fresh ``Workflow``):

- ``chain(verdict_by)``: solver -> verifier -> refiner. The verifier reads the problem and the
  solver's solution and gives a verdict (by default by solving again; ``"line"``: a verdict line); an
  accepted solution ends the episode with the solver's answer, a rejected (or unparseable) one goes,
  with the verifier's message, to the refiner, whose answer is final. Defaults: solver "" (no
  answer), verifier accepting (``Verdict: correct``, or the solver's message repeated), refiner the
  solver's message repeated (keeps the solver's answer).
- ``debate(num_agents, rounds)``: every debater answers each round; from round 2 on each reads the
  other debaters' previous-round messages; the final answer is the vote over the last round.
  Defaults: "" (no answer, so no vote).
- ``prefix(co_train)``: Prefix-RL as two roles: a prefix writer, then a solver (not trained unless
  ``co_train``) that continues the prefix (its prompt is the single-agent prompt followed by the
  prefix exactly as written, no delimiter added: a prefix cut mid-step by its token budget is
  continued mid-step, and an empty prefix leaves the single-agent prompt; its answer is read from
  prefix and continuation together). Defaults: "" for both (an empty prefix: the solver alone).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from envs.datasets import Problem
from envs.grader import extract_answer, strings_equiv
from envs.modes import AnswerRule, VerdictKind, member_of
from envs.prompts import format_prompt

ACCEPT = "Verdict: correct"
REJECT = "Verdict: wrong"
MAX_VERDICT_CHARS = 200  # the verdict line is short; reading a bounded tail keeps parsing O(1)
_VERDICT_LINE = re.compile(r"\s*verdict\s*:\s*(correct|wrong)\s*\.?\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Message:
    """One whole message, said at ``turn`` by agent slot ``slot`` whose role is named ``role``."""

    turn: int
    slot: int
    role: str
    text: str


@dataclass(frozen=True)
class TurnContext:
    """What a role may read when it is about to act at ``turn`` in slot ``slot``: the problem text
    (never the gold answer), the env's prompt template and the messages of the earlier turns."""

    problem: str
    template: str
    transcript: tuple[Message, ...]
    slot: int
    turn: int


@dataclass(frozen=True)
class DialogueLimits:
    """Truncation: an episode is cut after ``max_turns`` turns, or once its messages hold ``max_chars``
    characters (the prompts that show them would outgrow a model's context)."""

    max_turns: int
    max_chars: int


@dataclass(frozen=True)
class DialogueProgress:
    """Where an episode stands: the index of the next turn and the slots that act in it. No slots:
    the workflow ended the episode (``terminated``); ``truncated``: the limits cut it before."""

    turn: int
    slots: tuple[int, ...]
    truncated: bool

    @property
    def terminated(self) -> bool:
        return not self.slots

    @property
    def ended(self) -> bool:
        return self.terminated or self.truncated


@dataclass
class Dialogue:
    """One env's episode: its problem and group id (the ``problem_env``'s draw), the messages so far, where it
    stands and each slot's return so far, ``return_so_far`` [A]."""

    problem: Problem
    group_id: int
    transcript: list[Message]
    progress: DialogueProgress
    return_so_far: np.ndarray

    def acted(self) -> list[int]:
        """The slots that have said something in this episode."""
        return sorted({m.slot for m in self.transcript})


def parse_verdict(text: str) -> bool | None:
    """True for a final line ``Verdict: correct``, False for ``Verdict: wrong``, None for anything else
    (see the module docstring). Reads at most ``MAX_VERDICT_CHARS`` characters."""
    last_line = text[-MAX_VERDICT_CHARS:].rstrip().rpartition("\n")[2]
    match = _VERDICT_LINE.fullmatch(last_line)
    return None if match is None else match.group(1).lower() == "correct"


def role_prompt(context: TurnContext, messages: Sequence[Message], instruction: str) -> str:
    """``messages`` (each under ``[role name]``) and ``instruction``, each followed by a blank line, as the
    context of the single-agent prompt (the env's template around the problem text): the prompt ends as
    every prompt of the task does, and is exactly the single-agent one when both are empty."""
    parts = [*(f"[{m.role}]\n{m.text}" for m in messages), instruction]
    return format_prompt(context.problem, context.template, "".join(part + "\n\n" for part in parts if part))


def transcript_prompt(role: Role, context: TurnContext) -> str:
    """Every earlier message, then the role's instruction. A continuing role instead gets the
    single-agent prompt followed by the previous message, as written, as the solution so far."""
    if role.continues:
        prefix = context.transcript[-1].text if context.transcript else ""
        return format_prompt(context.problem, context.template) + prefix
    return role_prompt(context, context.transcript, role.instruction)


def state_prompt(role: Role, context: TurnContext) -> str:
    """What a centralized critic reads before ``role`` acts: the problem, every message so far (whether
    or not the role's own prompt shows it) and the acting role's name, so one value function serves
    every role from the joint transcript."""
    return role_prompt(context, context.transcript, f"[{role.name}]")


def previous_round_prompt(role: Role, context: TurnContext) -> str:
    """The other slots' messages of the previous turn, then the role's instruction; the first turn
    (nothing said yet) gets the single-agent prompt."""
    others = [m for m in context.transcript if m.turn == context.turn - 1 and m.slot != context.slot]
    return role_prompt(context, others, role.instruction if others else "")


PromptBuilder = Callable[["Role", TurnContext], str]
DefaultMessage = Callable[[TurnContext], str]
Schedule = Callable[[tuple[Message, ...], int], Sequence[int]]
"""(transcript, turn) -> the slots that act at ``turn``, increasing; empty: the episode is over."""


@dataclass(frozen=True)
class Role:
    """One agent slot's part in a workflow.

    name: how the other roles' prompts and the env's ``info["roles"]`` call it.
    instruction: text after the problem and the earlier messages that tells the role its task.
    prompt: builds its prompt from a ``TurnContext`` (``transcript_prompt``, ``previous_round_prompt``
        or your own).
    trainable: whether the trainer updates it (False: the frozen base model speaks for it).
    default: what it says in the counterfactual that measures its credit: a text, or a function of
        the ``TurnContext`` (e.g. ``repeat("solver")``).
    answers: its message holds an answer (``\\boxed{}``) that is verified and can be final.
    judges: the name of the role whose latest answer its verdict is about (a verifier).
    verdict_by: how a judging role gives its verdict: ``VerdictKind.LINE`` or ``SOLVING`` (module docstring).
    continues: its message continues the previous message as one solution (Prefix-RL's solver).
    """

    name: str
    instruction: str = ""
    prompt: PromptBuilder = transcript_prompt
    trainable: bool = True
    default: str | DefaultMessage = ""
    answers: bool = True
    judges: str | None = None
    verdict_by: VerdictKind = VerdictKind.LINE
    continues: bool = False

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"Role name={self.name!r} must be a non-empty string")
        if self.answers and self.judges is not None:
            raise ValueError(f"Role {self.name!r} both answers and judges {self.judges!r}; its individual credit "
                             "would be ambiguous: give it answers=False or judges=None")
        object.__setattr__(self, "verdict_by", member_of(tuple(VerdictKind), self.verdict_by,
                                                         f"Role {self.name!r} verdict_by"))

    def build_prompt(self, context: TurnContext) -> str:
        return self.prompt(self, context)

    def default_message(self, context: TurnContext) -> str:
        return self.default(context) if callable(self.default) else self.default

    def verdict(self, text: str, judged_answer: str | None) -> bool | None:
        """This judging role's verdict in its message ``text`` on a solution whose answer is
        ``judged_answer``: True accept, False reject, None unparseable (module docstring)."""
        if self.verdict_by is VerdictKind.LINE:
            return parse_verdict(text)
        own = extract_answer(text)
        if own is None:
            return None
        return judged_answer is not None and strings_equiv(own, judged_answer)


def _latest(transcript: Sequence[Message], index: int, matches: Callable[[Message], bool]) -> int | None:
    """Index of the latest message before ``index`` that ``matches`` (None if none does)."""
    return next((j for j in range(index - 1, -1, -1) if matches(transcript[j])), None)


def _latest_text(role_name: str, context: TurnContext) -> str:
    return next((m.text for m in reversed(context.transcript) if m.role == role_name), "")


def repeat(role_name: str) -> DefaultMessage:
    """A default that repeats the latest message of ``role_name`` ("" if it said nothing): keeps its answer."""
    return functools.partial(_latest_text, role_name)


@dataclass(frozen=True)
class Workflow:
    """Roles (one per agent slot), a ``Schedule`` and the answer rule (``AnswerRule.LAST`` or ``VOTE``).
    ``max_turns``: the most turns its schedule ever runs (None: unbounded, the env's limit cuts it);
    what a trainer sizes its rollout by."""

    name: str
    roles: tuple[Role, ...]
    schedule: Schedule
    answer: AnswerRule = AnswerRule.LAST
    max_turns: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", tuple(self.roles))
        if not self.roles or not all(isinstance(role, Role) for role in self.roles):
            raise ValueError(f"workflow {self.name!r} needs a non-empty sequence of envs.workflows.Role, "
                             f"got {self.roles!r:.200}")
        names = self.role_names
        if len(set(names)) != len(names):
            raise ValueError(f"workflow {self.name!r} has repeated role names {names}; give each slot its own name")
        for role in self.roles:
            if role.judges is not None and role.judges not in names:
                raise ValueError(f"role {role.name!r} of workflow {self.name!r} judges {role.judges!r}, which is "
                                 f"none of its roles {names}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"workflow {self.name!r} max_turns={self.max_turns} must be >= 1 (or None: unbounded)")
        object.__setattr__(self, "answer", member_of(tuple(AnswerRule), self.answer, f"workflow {self.name!r} answer"))
        if not self.scheduled((), 0):
            raise ValueError(f"workflow {self.name!r} schedules no slot at turn 0: its episodes would be empty")

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(role.name for role in self.roles)

    def scheduled(self, transcript: Sequence[Message], turn: int) -> tuple[int, ...]:
        """The slots that act at ``turn`` after ``transcript``, checked."""
        slots = tuple(self.schedule(tuple(transcript), turn))
        if (not all(isinstance(slot, int) and 0 <= slot < len(self.roles) for slot in slots)
                or list(slots) != sorted(set(slots))):
            raise ValueError(f"workflow {self.name!r}'s schedule gave slots {slots!r:.200} at turn {turn}; it must "
                             f"return distinct increasing slot indices in [0, {len(self.roles)})")
        return slots

    def progress(self, transcript: Sequence[Message], limits: DialogueLimits) -> DialogueProgress:
        """Where an episode with ``transcript`` stands (turns that were scheduled always hold messages)."""
        turn = transcript[-1].turn + 1 if transcript else 0
        slots = self.scheduled(transcript, turn)
        chars = sum(len(m.text) for m in transcript)
        truncated = bool(slots) and (turn >= limits.max_turns or chars >= limits.max_chars)
        return DialogueProgress(turn, slots, truncated)

    def solution_of(self, transcript: Sequence[Message], index: int) -> str:
        """The solution message ``index`` holds: its text, after the previous message's for a continuing
        role (the prefix it continued, as its prompt showed it)."""
        message = transcript[index]
        if self.roles[message.slot].continues and index > 0:
            return transcript[index - 1].text + message.text
        return message.text

    def answer_of(self, transcript: Sequence[Message], index: int) -> str | None:
        """The answer in message ``index``'s solution (``solution_of``)."""
        return extract_answer(self.solution_of(transcript, index))

    def judged(self, transcript: Sequence[Message], index: int) -> int | None:
        """Index of the message that message ``index``'s verdict is about: the latest one before it of
        the role its role judges (None if that role has not spoken)."""
        judged_role = self.roles[transcript[index].slot].judges
        return _latest(transcript, index, lambda message: message.role == judged_role)

    def revised(self, transcript: Sequence[Message], index: int) -> int | None:
        """Index of the message that answering message ``index`` revises: the one the latest verdict before
        it judged (the chain's refiner revises the solution the verifier rejected); None when no verdict
        came before it."""
        judge = _latest(transcript, index, lambda message: self.roles[message.slot].judges is not None)
        return None if judge is None else self.judged(transcript, judge)

    def candidate_indices(self, transcript: Sequence[Message]) -> list[int]:
        """Indices of the messages whose answers the final answer is chosen from: ``LAST``, the last answering
        message; ``VOTE``, those of the last turn in which answering roles spoke; none when no answering role
        spoke."""
        answering = [i for i, m in enumerate(transcript) if self.roles[m.slot].answers]
        if not answering or self.answer is AnswerRule.LAST:
            return answering[-1:]
        last_turn = transcript[answering[-1]].turn
        return [i for i in answering if transcript[i].turn == last_turn]

    def candidates(self, transcript: Sequence[Message]) -> tuple[str | None, ...]:
        """The answers of the ``candidate_indices`` messages (None: a message without one); (None,) when no
        answering role spoke."""
        indices = self.candidate_indices(transcript)
        return tuple(self.answer_of(transcript, i) for i in indices) if indices else (None,)

    @staticmethod
    def vote_groups(candidates: Sequence[str | None], equivalent: Callable[[str, str], bool]) -> list[list[int]]:
        """The positions of ``candidates`` as a vote groups them: each answer joins the first group whose first
        answer it is equivalent to (``equivalent(a, b)`` asked only of two candidates, ``a`` before ``b``); an
        answer of None joins none. The largest group wins, a tie going to the earliest: the first group of
        ``max(groups, key=len)``."""
        groups: list[list[int]] = []
        for k, answer in enumerate(candidates):
            if answer is None:
                continue
            group = next((g for g in groups if equivalent(candidates[g[0]], answer)), None)
            if group is None:
                groups.append([k])
            else:
                group.append(k)
        return groups

    def final_answer(self, candidates: Sequence[str | None], equivalent: Callable[[str, str], bool]) -> str | None:
        """The final answer among ``candidates``: ``LAST``, the last; ``VOTE``, the first answer of the winning
        group of ``vote_groups``, None when nobody answered."""
        if self.answer is AnswerRule.LAST:
            return candidates[-1]
        groups = self.vote_groups(candidates, equivalent)
        return candidates[max(groups, key=len)[0]] if groups else None

    def replay(self, problem: str, template: str, transcript: Sequence[Message], slot: int,
               limits: DialogueLimits) -> tuple[Message, ...]:
        """The transcript had slot ``slot`` said its default wherever it acted, every other slot saying
        what it actually said at the same (turn, slot). The schedule runs again on the replayed
        transcript: a slot it adds says its default, a slot it drops is dropped."""
        actual = {(m.turn, m.slot): m.text for m in transcript}
        replayed: list[Message] = []
        progress = self.progress(replayed, limits)
        while not progress.ended:
            earlier = tuple(replayed)
            for acting in progress.slots:
                text = actual.get((progress.turn, acting)) if acting != slot else None
                if text is None:
                    context = TurnContext(problem, template, earlier, acting, progress.turn)
                    text = self.roles[acting].default_message(context)
                replayed.append(Message(progress.turn, acting, self.roles[acting].name, text))
            progress = self.progress(replayed, limits)
        return tuple(replayed)


def _in_order(num_slots: int, transcript: tuple[Message, ...], turn: int) -> tuple[int, ...]:
    """Slot ``turn`` alone at each turn, until every slot has spoken once."""
    return (turn,) if turn < num_slots else ()


def _chain_schedule(verifier: Role, transcript: tuple[Message, ...], turn: int) -> tuple[int, ...]:
    """Solver, verifier, then the refiner only if the verifier did not accept."""
    if turn < 2:
        return (turn,)
    if turn == 2 and verifier.verdict(transcript[1].text, extract_answer(transcript[0].text)) is not True:
        return (2,)
    return ()


def _every_slot(num_slots: int, rounds: int, transcript: tuple[Message, ...], turn: int) -> tuple[int, ...]:
    return tuple(range(num_slots)) if turn < rounds else ()


VERIFIER_INSTRUCTIONS = {
    VerdictKind.LINE: f"Verifier: check the solver's steps. End with '{ACCEPT}' or '{REJECT}'.",
    VerdictKind.SOLVING: ("Verifier: solve it yourself, answer in \\boxed{}. The solution stands if your answer is the "
                          "same."),
}
REFINER_INSTRUCTION = ("Refiner: the verifier did not accept the solver's solution. Write a corrected one, answer "
                       "in \\boxed{}.")
DEBATER_INSTRUCTION = "Debater {k}: above are the others' last solutions. Solve it, answer in \\boxed{{}}."


def chain(verdict_by: VerdictKind = VerdictKind.SOLVING) -> Workflow:
    """Solver -> verifier -> refiner, the verifier's verdict given ``verdict_by`` (see the module docstring)."""
    verdict_by = member_of(tuple(VerdictKind), verdict_by, "chain verdict_by")
    solver = Role("solver", default="")
    verifier = Role("verifier", instruction=VERIFIER_INSTRUCTIONS[verdict_by], answers=False, judges="solver",
                    verdict_by=verdict_by, default=ACCEPT if verdict_by is VerdictKind.LINE else repeat("solver"))
    refiner = Role("refiner", instruction=REFINER_INSTRUCTION, default=repeat("solver"))
    return Workflow("chain", (solver, verifier, refiner), schedule=functools.partial(_chain_schedule, verifier),
                    max_turns=3)


def debate(num_agents: int = 3, rounds: int = 2) -> Workflow:
    """``num_agents`` debaters (slots ``debater_0``...) answer in each of ``rounds`` rounds; majority vote."""
    if num_agents < 1 or rounds < 1:
        raise ValueError(f"debate needs num_agents >= 1 and rounds >= 1, got num_agents={num_agents}, "
                         f"rounds={rounds}")
    roles = tuple(
        Role(f"debater_{k}", prompt=previous_round_prompt, default="", instruction=DEBATER_INSTRUCTION.format(k=k))
        for k in range(num_agents)
    )
    return Workflow("debate", roles, schedule=functools.partial(_every_slot, num_agents, rounds),
                    answer=AnswerRule.VOTE, max_turns=rounds)


def prefix(co_train: bool = False) -> Workflow:
    """Prefix-RL: a prefix writer, then a solver that continues it (trained too only if ``co_train``)."""
    writer = Role("prefix_writer", default="", answers=False)
    solver = Role("solver", trainable=co_train, default="", continues=True)
    return Workflow("prefix", (writer, solver), schedule=functools.partial(_in_order, 2), max_turns=2)


WORKFLOWS: dict[str, Callable[[], Workflow]] = {"chain": chain, "debate": debate, "prefix": prefix}


def resolve_workflow(workflow: Workflow | str) -> Workflow:
    """A ``Workflow``, or the built-in of that name with its default arguments."""
    if isinstance(workflow, Workflow):
        return workflow
    if not isinstance(workflow, str) or workflow not in WORKFLOWS:
        raise ValueError(f"workflow={workflow!r:.100} is neither an envs.workflows.Workflow nor one of the built-ins "
                         f"{sorted(WORKFLOWS)}")
    return WORKFLOWS[workflow]()
