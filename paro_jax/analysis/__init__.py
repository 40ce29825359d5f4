"""What a strategy costs: analytic formulas, compiled-program inspection, the planner."""
