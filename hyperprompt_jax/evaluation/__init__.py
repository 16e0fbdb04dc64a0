"""Evaluation of checkpoints by each paper's protocol (`evaluator`,
`eval_summary`, `paper_results`) and during training (`during_training`),
batched greedy prediction on the mesh (`predictor`), inference
(`inference`), test-server files (`submission_files`) and the attention
probe (`attention_probe`)."""
