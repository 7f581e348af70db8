"""Multi-turn agentic rollouts: environments, tools and their sandbox, token-exact trajectories."""
