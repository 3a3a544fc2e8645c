"""The Llama-family transformer: the forward pass, its layers and the step's batch tensors."""
