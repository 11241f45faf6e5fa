{{/* Names and labels shared by the templates. */}}

{{- define "qag.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "qag.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "qag.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "qag.selectorLabels" -}}
app.kubernetes.io/name: {{ include "qag.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "qag.labels" -}}
helm.sh/chart: {{ include "qag.chart" . }}
{{ include "qag.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The Secret holding QAG_ADMIN_KEY, QAG_SECRET_KEY, QAG_DATABASE_URL, ... */}}
{{- define "qag.secretName" -}}
{{- if .Values.secrets.existingSecret -}}
{{- .Values.secrets.existingSecret -}}
{{- else -}}
{{- include "qag.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "qag.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Several replicas each with its own SQLite store would serve different keys and queries. */}}
{{- define "qag.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.secrets.existingSecret) (not .Values.secrets.databaseUrl) -}}
{{- fail "replicaCount > 1 needs the shared PostgreSQL store: set secrets.databaseUrl or secrets.existingSecret" -}}
{{- end -}}
{{- if not (has (int .Values.runWriters) (list 1 2 4 8 16)) -}}
{{- fail "runWriters must be 1, 2, 4, 8 or 16" -}}
{{- end -}}
{{- if gt (int .Values.replicaCount) (int .Values.runWriters) -}}
{{- fail "replicaCount is above runWriters: two pods would mint the same event ids (raise runWriters, up to 16)" -}}
{{- end -}}
{{- if and (not .Values.secrets.create) (not .Values.secrets.existingSecret) -}}
{{- fail "secrets.create is false: set secrets.existingSecret" -}}
{{- end -}}
{{- end -}}
