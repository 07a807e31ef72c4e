-- Runs once, when the PostgreSQL volume is first initialised (docker-entrypoint-initdb.d), as POSTGRES_USER.
-- The image itself creates POSTGRES_DB (mlflow: runs, params, metrics, the model registry); these are the other
-- two databases of the stack.
CREATE DATABASE mlflow_auth;  -- MLflow's basic-auth users and permissions (docker/mlflow-auth.ini)
CREATE DATABASE optuna;       -- Optuna RDB storage for `maxout hpo` studies, read by optuna-dashboard
