"""The training run (`llmtrain train`, or `deepspeed --module llmtrain.train`)."""
