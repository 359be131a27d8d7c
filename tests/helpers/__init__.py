"""What the tests share: tensor comparisons, tiny models and override lists, tiny diffusers pipelines, process-group
bootstraps, remote-code masked LMs, reward models and reward callables, CLI subprocesses and tracker logs."""
