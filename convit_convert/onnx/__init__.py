"""ONNX in and out: trusted loading (`load.py`), the sizes a graph
takes from its input's shape (`shapes.py`), the graph matcher (`graph.py`), the ViT reader
(`read.py`), the layout proof (`layout.py`), the import with its onnxruntime check
(`importer.py`), and export (`export.py`; its options are `options.operations.ExportOptions`)."""
