FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends libgl1 libglib2.0-0 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt
COPY . .
ENV PYTHONUNBUFFERED=1 DJANGO_SETTINGS_MODULE=project.settings
# 8000: the web; 9100: a worker's own metrics endpoint (METRICS_PORT). .dockerignore keeps .env,
# var/ and .venv out of COPY.
EXPOSE 8000 9100
