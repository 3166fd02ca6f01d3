"""Flags of the learning algorithm: which one, the optimiser, and the losses' coefficients."""

from __future__ import annotations

from absl import flags

from algorithms.registry import ALGORITHMS, ImportanceSamplingLevel, KLEstimator, LossAgg, ScaleRewards
from train.config import LrSchedule

flags.DEFINE_enum("algorithm_name", "GRPO", tuple(ALGORITHMS), "RL algorithm (any case: reinforce_pp is REINFORCE_PP): "
                  "REINFORCE_PP and REINFORCE_PP_BASELINE are REINFORCE++ and REINFORCE++-baseline (Hu 2025).",
                  case_sensitive=False)
flags.DEFINE_integer("num_mini_batch", 1, "Minibatches (optimizer steps) per epoch over each rollout.", lower_bound=1)
flags.DEFINE_integer("ppo_epoch", 1, "Epochs over each rollout.", lower_bound=1)
flags.DEFINE_integer("gradient_cp_steps", 1, "Gradient accumulation: micro-batches per minibatch.", lower_bound=1)
flags.DEFINE_integer("micro_batch_tokens", 0, "Most tokens one micro-batch forwards (a shared prompt once, then each "
                     "action): micro-batches are cut further until each fits, rows of one prompt kept together, the "
                     "gradient unchanged. It bounds the update's activation memory; 0: no limit.", lower_bound=0)
flags.DEFINE_float("lr", 1e-4, "Policy learning rate (AdamW).")
flags.DEFINE_float("critic_lr", 1e-3, "Critic learning rate (value head and critic adapter).")
flags.DEFINE_integer("warmup_iterations", 20, "Linear lr warm-up length in iterations (Adam's first steps move "
                     "every weight by about lr; warm-up keeps them small).", lower_bound=0)
flags.DEFINE_enum("lr_schedule", LrSchedule.LINEAR, [mode.value for mode in LrSchedule],
                  "After warm-up: linear decay to 0 at the last "
                  "iteration, or constant. A run resumed with another --num_env_steps goes on at the new budget's "
                  "lr for the step it has reached.")
flags.DEFINE_float("max_grad_norm", 1.0, "Gradient norm clip (0: off).")
flags.DEFINE_float("clip_param", 0.2, "PPO ratio clip epsilon: the ratio is kept within [1 - eps, 1 + eps] "
                   "(--clip_ratio_low / --clip_ratio_high set either side apart).")
flags.DEFINE_float("clip_ratio_low", None, "Lower clip epsilon: the ratio's floor is 1 - this where the advantage is "
                   "negative (verl's clip_ratio_low, TRL's epsilon). Default: --clip_param.")
flags.DEFINE_float("clip_ratio_high", None, "Upper clip epsilon: the ratio's ceiling is 1 + this where the advantage "
                   "is positive; above --clip_ratio_low it is DAPO's clip-higher (e.g. 0.28 over 0.2), room for "
                   "unlikely tokens to grow (verl's clip_ratio_high, TRL's epsilon_high). Default: --clip_param.")
flags.DEFINE_float("clip_ratio_c", None, "Dual-clip (Ye et al. 2020): where the advantage is negative the loss is "
                   "at most c |A|, so a ratio far above 1 cannot push the update without bound; > 1, verl uses 3.0 "
                   "(its clip_ratio_c). Default: off.")
flags.DEFINE_enum("importance_sampling_level", ImportanceSamplingLevel.TOKEN,
                  [level.value for level in ImportanceSamplingLevel], "The clipped ratio per token, or per action: "
                  "exp of the mean of its tokens' log-ratios, clipped as a whole (GSPO, Zheng et al. 2025, which "
                  "clips at about 3e-4 and 4e-4; TRL's importance_sampling_level, verl's policy_loss gspo).")
flags.DEFINE_float("entropy_coef", 0.0, "Entropy bonus coefficient.")
flags.DEFINE_float("target_kl", 0.0, "Stop the update early once a minibatch's approx KL to the behaviour policy "
                   "exceeds this (0: off).")
flags.DEFINE_integer("max_nonfinite_steps", 3, "A non-finite loss or gradient skips that optimizer step; this many "
                     "in a row stop the run with an error (the last checkpoint is kept as the last good one).",
                     lower_bound=1)
flags.DEFINE_enum("critic", "auto", ("auto", "on", "off", "centralized", "per_role"), "Train a critic: auto = "
                  "APPO/TPPO yes, GRPO/RLOO no. On a multi-agent env (APPO/TPPO) it says what the critic reads: "
                  "centralized (= auto, on): the joint transcript (every message so far) and the acting role's name, "
                  "one value head (MAPPO); per_role: each role's own prompt, a value head per role.")
flags.DEFINE_float("value_coef", 0.5, "Value loss coefficient.")
flags.DEFINE_float("value_clip_param", 0.2, "Value clip around the collection-time values (0: off).")
flags.DEFINE_float("huber_delta", 0.0, "Huber delta of the value loss (0: squared error).")
flags.DEFINE_float("gamma", 1.0, "Discount across env steps.")
flags.DEFINE_float("gae_lambda", 0.95, "GAE lambda of the policy's advantages.")
flags.DEFINE_float("value_lambda", 1.0, "GAE lambda of the critic's targets (Decoupled GAE, as VAPO): 1.0 fits V "
                   "to the returns the rewards give; below 1 a token j steps before the reward sees it with weight "
                   "lambda^j and V is fitted mostly to its own later values.")
flags.DEFINE_enum("scale_rewards", ScaleRewards.GROUP, [mode.value for mode in ScaleRewards],
                  "Divide centred returns by the "
                  "group's std, the batch's, or nothing (Dr.GRPO).")
flags.DEFINE_float("kl_coef", 0.0, "KL-to-reference coefficient beta, in the loss or, with --use_kl_in_reward, in "
                   "the reward (0: no KL and no reference pass).")
flags.DEFINE_enum("kl_loss_type", KLEstimator.K3, [kind.value for kind in KLEstimator], "Estimator of the loss's KL "
                  "term (Schulman's k1, k2, k3; low_var_kl: k3 bounded to [-10, 10] as verl's; verl's kl_loss_type).")
flags.DEFINE_boolean("use_kl_in_reward", None, "The KL to the reference as a penalty beta * KL_t on every token's "
                     "reward instead of a loss term (verl's use_kl_in_reward); algorithms with one advantage per "
                     "action sum it into the action's reward. Default: on for REINFORCE_PP(_BASELINE), else off.")
flags.DEFINE_enum("kl_penalty", KLEstimator.K1, [kind.value for kind in KLEstimator], "Estimator of the reward's "
                  "KL penalty, from the behaviour log-probs (verl's kl_penalty; k1 is verl's 'kl').")
flags.DEFINE_enum("loss_agg_mode", LossAgg.TOKEN_MEAN, [mode.value for mode in LossAgg], "How per-token losses "
                  "become one (verl's names): token-mean (every token weighs the same, DAPO), seq-mean-token-mean "
                  "(every action weighs the same, GRPO), seq-mean-token-sum, seq-mean-token-sum-norm (each action's "
                  "token sum over a fixed length, --loss_scale_factor: Dr. GRPO).")
flags.DEFINE_integer("loss_scale_factor", None, "The fixed length seq-mean-token-sum-norm divides each action's token "
                     "sum by (verl's loss_scale_factor). Default: --max_new_tokens.", lower_bound=1)
