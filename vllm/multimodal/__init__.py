"""Image inputs (vLLM's multimodal API): what a prompt's images become on their way to the
model (``inputs``), how the front end turns images into them (``processing``), and how
the server loads an image a request names (``media``)."""
