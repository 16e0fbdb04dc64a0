"""Evaluation of checkpoints by each paper's protocol (`eval`,
`eval_summary`, `paper_results`), inference (`infer`), test-server files
(`leaderboard`) and the attention probe (`probe`)."""
