"""The freezing core: modules, the engine, the policy contract and the base callback.

`modules` partitions a model into front-to-back modules; `engine` freezes and
re-opens them (the one place that flips `trainable` and rebuilds the train
function); `policy` is the contract every policy fulfils (`observe` ->
`Decision`, `get_state`/`set_state`); `probe` draws the fixed probe batch and
reads layer activations on it; `batch_norm` refreshes BatchNormalization
statistics before a freeze; `budget` weighs what evaluating costs against
what a freeze can still save; `callback` (`FreezingCallback`) ties a policy
into `model.fit`. Egeria (`tf_hwopt.egeria`) and the peers
(`tf_hwopt.peers`) are policies on this core.
"""

from tf_hwopt.freezing.budget import best_case_saving_seconds, stretched_interval, worth_evaluating
from tf_hwopt.freezing.batch_norm import BatchNormRefresher, batch_norm_drift
from tf_hwopt.freezing.callback import FreezingCallback
from tf_hwopt.freezing.engine import FreezingEngine
from tf_hwopt.freezing.modules import Module, describe_modules, partition_modules
from tf_hwopt.freezing.policy import Decision, FreezingPolicy, max_frozen_modules
from tf_hwopt.freezing.probe import ActivationReader, draw_probe
