"""The file MLflow logs as the model ("models from code"): run at logging and at every load, it names the pyfunc.

``pyfunc.log_model`` gives MLflow this file's path, not an object, so nothing is pickled: the model is this code
plus the maxout package beside it (``code_paths``) and the weights (``artifacts``). MLflow runs it as a standalone
module (``code/model_code.py`` inside the logged model), so the import is absolute: at load time ``maxout`` comes
from the model's own ``code/`` folder when the consumer has no maxout installed.
"""

from mlflow.models import set_model

from maxout.serving.pyfunc import TextClassifier

set_model(TextClassifier())
