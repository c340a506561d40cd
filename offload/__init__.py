"""offload: train and run models far larger than the device that runs them."""
