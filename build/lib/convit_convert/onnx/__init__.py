"""ONNX in and out: trusted loading (load), the graph matcher (graph), the ViT reader (read), the
layout proof (layout), the import with its onnxruntime check (importer), and export (export)."""
