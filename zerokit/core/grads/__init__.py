"""Gradients: reducing them, the hooks that trigger it, and what `param.grad` shows user code.

`grad_reduce.py` (`GradReduction`: reduce-scatter / all-reduce of each flat gradient), `hooks.py`
(autograd hooks per flat param), `user_grads.py` (the engine's `UserGrads` mixin). Imports
core/params, core/collectives and core/'s nest, precision and config.
"""
