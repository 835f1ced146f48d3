"""``fzero.Config``: DeepSpeed's JSON config format, read into keyword-only dataclasses.

A DeepSpeed config (a dict, a JSON file, or JSON text) becomes a frozen :class:`Config`
with one dataclass per section. :meth:`Config.compile_options` gives the keyword options of
``fzero.compile``; :meth:`Config.make_optimizer` builds the ``optimizer`` section, with the
``scheduler`` section as its learning rate, as ``deepspeed.initialize`` builds them.

Every key is accounted for, and every problem of a file is reported at once (several in
one :class:`ConfigError`). A key DeepSpeed does not know (a typo) is a
:class:`ConfigKeyError` naming it with its dotted path and the nearest valid key, at every
nesting level. A DeepSpeed feature fzero does not implement is a ``NotImplementedError``
naming the key. A DeepSpeed key that only tunes speed, memory or logging, which fzero does
differently or not at all, is accepted; when its value asks for something (not DeepSpeed's
default) it is listed in ``Config.ignored`` and in one ``UserWarning``. Hugging Face's
``"auto"`` values are filled as its Trainer fills them (:mod:`fzero.config._auto`).
docs/config.md has the whole table.

DeepSpeed's semantics were read from ``deepspeed/runtime/config.py``,
``runtime/zero/config.py``, ``runtime/precision_config.py``, ``runtime/engine.py``
(``_configure_basic_optimizer``) and ``ops/{adam,lamb,lion}`` of DeepSpeed 0.19.8.

Example:
    >>> from fzero import optim
    >>> from fzero.config import Config      # fzero.Config once fzero/__init__.py exports it
    >>> cfg = Config.load({
    ...     "train_batch_size": 8, "gradient_accumulation_steps": 1,
    ...     "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    ...     "fp16": {"enabled": True}, "zero_optimization": True})
    >>> cfg.train_micro_batch_size_per_gpu, cfg.zero_optimization.stage
    (8, 1)
    >>> opts = cfg.compile_options()
    >>> opts.precision, opts.loss_scale, opts.accumulate
    ('fp16', 'dynamic', 1)
    >>> optim.fused_spec_of(cfg.make_optimizer()).kind   # DeepSpeed's "Adam" is AdamW unless adam_w_mode=false
    'adamw'
"""

from fzero.config._auto import AutoFill
from fzero.config._config import Config
from fzero.config._keys import GRADIENT_CLIPPING_DEFAULT, ConfigError, ConfigKeyError
from fzero.config._sections import BF16Config, FP16Config, OptimizerConfig, SchedulerConfig, ZeroConfig
from fzero.config._values import WHERE
from fzero.optim.deepspeed import ScaleByDeepSpeedLambState  # here before it moved to fzero.optim

__all__ = [
    "AutoFill",
    "BF16Config",
    "Config",
    "ConfigError",
    "ConfigKeyError",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
]
