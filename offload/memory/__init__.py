"""Where a byte lives: the tiers and their budgets (tiers), the flat blocks a model is cut into
(blocks, layout) and weights mapped from files (mapped). See README.md beside this file."""
