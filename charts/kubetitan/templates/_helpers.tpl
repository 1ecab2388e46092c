{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "kubetitan.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: the release name, unless it already contains the chart name. */}}
{{- define "kubetitan.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kubetitan.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kubetitan.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubetitan.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kubetitan.labels" -}}
helm.sh/chart: {{ include "kubetitan.chart" . }}
{{ include "kubetitan.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubetitan
{{- end }}

{{- define "kubetitan.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kubetitan.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false: name an existing ServiceAccount" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The namespaces the operator watches in namespaced mode (default: the release namespace). */}}
{{- define "kubetitan.watchNamespaces" -}}
{{- if .Values.watch.namespaces }}
{{- .Values.watch.namespaces | uniq | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{- define "kubetitan.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
