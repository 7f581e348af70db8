"""The only code that knows Ray and torch.distributed set-up: actor groups, placement, dispatch, collectives."""
