"""maxout: fine-tune transformer encoders with every GPU speed-up as a measured, MLflow-logged flag."""

__version__ = "0.1.0"
