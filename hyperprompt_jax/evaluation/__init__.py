"""Evaluation of checkpoints by each paper's protocol (`eval`,
`eval_summary`, `paper_results`) and during training (`during_training`),
batched greedy prediction on the mesh
(`predictor`), inference (`infer`), test-server files (`leaderboard`) and
the attention probe (`probe`)."""
