"""The only code that knows Ray and torch.distributed set-up: actor groups, placement, dispatch, collectives."""

from roll_backend.distributed.ray_env import apply_ray_env_defaults

# Before any module here imports ray: Ray reads some of these once, at import (see ray_env).
apply_ray_env_defaults()
