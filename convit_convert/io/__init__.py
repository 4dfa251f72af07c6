"""Files: the checkpoint format (`checkpoint.py`: read, validate, write; `safetensors_writer.py`:
one pass, hashed), atomic writes (`atomic.py`) and their commit journal read as untrusted input
(`journal.py`), the paths a user gives (`paths.py`), the one
way to touch files in an output folder (`folder.py`) and the one door from an output path to it
(`outputs.py`), the run folder's lock (`lock.py`), the one image reader (`images.py`), JSON
reports (`report.py`) and timm's pretrained folder (`timm_folder.py`) with its model card
(`model_card.py`), and models on the Hugging Face Hub (`hub.py`)."""
