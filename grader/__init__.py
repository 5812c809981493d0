"""The grader behind reward.py: where an answer sits in a response (extraction), how its text is
cleaned (normalize), the math answer parser (parser), equality (equivalence), and every budget
(limits); and your own reward function, loaded and called in its place (user_reward)."""
