# syntax=docker/dockerfile:1
# The platform services of docker/compose.yaml: the MLflow tracking server (with its basic-auth app, the
# PostgreSQL driver and boto3 for the S3 artifact store) and optuna-dashboard. Built from the same lock as the
# trainer (constraints.txt), so the server speaks the clients' MLflow version and the dashboard reads Optuna's
# tables with the Optuna version that wrote them. No credentials inside: compose passes them as environment.
#
# Python 3.11: the interpreter the lock was resolved with. Every package here ships a wheel, so no compiler and
# no second stage are needed.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY constraints.txt /tmp/constraints.txt
RUN pip install -c /tmp/constraints.txt "mlflow[auth]" psycopg2-binary boto3 optuna-dashboard gunicorn \
    && rm /tmp/constraints.txt

RUN groupadd --gid 10001 mlflow \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin mlflow
USER 10001:10001
WORKDIR /home/mlflow
EXPOSE 5000

# The default command is the tracking server (compose gives the full command line); /health needs no login.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=5 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:5000/health', timeout=4)"]
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
