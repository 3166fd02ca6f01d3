"""The built-in tiny models: tokenizer, policy, PRM, target solver, team and tool model, trained on a CPU.

    python -m models.tiny --out DIR      # DIR/policy, DIR/prm, DIR/target, DIR/team-<hash>, DIR/tool-<hash>,
                                         # DIR/metrics.json

They let the trainer, the tests and the benchmarks run end to end with nothing downloaded. One build
ships inside the package (``models.tiny.shipped``: ``shipped_models()``), the default of every command
that needs a tiny model, so every machine starts at once from the same weights; ``build_tiny_models``
builds one's own (into ``$MATHRL_CACHE`` by default). Each
model directory is an ordinary Hugging Face one (``save_pretrained`` of a Llama causal LM and its
tokenizer), loaded back with the Auto classes: the code path a user's own model takes.

- policy: a small Llama fine-tuned on Arith reference solutions, stopped at modest accuracy so RL
  has room to improve it.
- target: the same run continued (Prefix-RL's frozen solver).
- team: the policy taught the roles of the built-in multi-agent workflows (``models.tiny.roles``): a
  verifier that solves again, a refiner's rewrite, a debater's second round; the default model of the
  multi-agent envs, a build stage of its own (``config.team_hash``).
- tool: the policy taught to call the env's Python tool (``models.tiny.tool``): a python block printing
  the problem's expression, then the boxed output; a build stage of its own (``config.tool_hash``).
- prm: Math-Shepherd format (``envs.prompts.shepherd_text``), P("+") over {"+", "-"} at each step
  tag; a likelihood verifier (``models.tiny.likelihood_prm``) on the target's trunk.

Modules: ``config`` (knobs and cache key), ``tokenizer``, ``model``, ``data`` (Arith batches and
corrupted solutions), ``training``, ``roles`` (the team model), ``tool`` (the tool model), ``evaluation``,
``likelihood_prm``, ``build`` (a build, kept and reused), ``shipped`` (the build the package carries).
Only train_math.py's default-model path, the tests and the benchmarks import this package.
"""

from models.tiny.build import TinyModels, build_tiny_models
from models.tiny.config import TinyConfig, cache_dir, config_hash
from models.tiny.data import heldout_problems
from models.tiny.evaluation import arith_accuracy, prm_metrics
from models.tiny.model import save_untrained_policy
from models.tiny.shipped import SHIPPED_DIR, shipped_models
from models.tiny.tokenizer import build_tokenizer

__all__ = [
    "TinyConfig", "TinyModels", "arith_accuracy", "build_tiny_models", "build_tokenizer", "cache_dir", "config_hash",
    "heldout_problems", "prm_metrics", "save_untrained_policy", "SHIPPED_DIR", "shipped_models",
]
