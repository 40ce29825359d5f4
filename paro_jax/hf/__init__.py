"""The model's way in and out: Hugging Face weights (safetensors, transformers' layout) and PEFT
adapters, read into and written from our parameter trees. Above core/ (it may place what it reads
on a mesh); the commands that restore a checkpoint and then write (export, eval) sit in run/.
"""
