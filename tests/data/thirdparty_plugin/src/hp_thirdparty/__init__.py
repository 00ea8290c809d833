"""A third-party plugin: a sign-SGD optimizer and a step-halving LR schedule."""
