"""LoRA adapters (vLLM's ``vllm.lora``): ``LoRARequest`` names one for a request;
``peft.py`` reads PEFT checkpoints, ``layers.py`` adds every adapter's update to the
model's linear layers in one batch, ``manager.py`` gives adapters device slots."""
