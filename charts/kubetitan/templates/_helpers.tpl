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

{{/*
The ValidatingWebhookConfiguration's webhooks (templates/webhook.yaml). The same text goes to the operator as
--webhook-configuration-webhooks (templates/deployment.yaml): with webhook.certificates=operator it may update the
configuration (for its caBundle), and it restores every other field to this whenever they drift
(kubetitan.webhook_config). Called with (dict "root" .); caBundle is never rendered (the operator or cert-manager's
CA injector fills it).
*/}}
{{- define "kubetitan.webhooks" -}}
{{- $ := .root }}
{{- $fullname := include "kubetitan.fullname" $ -}}
- name: validate.llamapretrains.kubetitan.io
  admissionReviewVersions: ["v1"]
  sideEffects: None
  # Fail: while no replica answers, LlamaPretrains cannot be created or changed (deletes, status writes and
  # everything else go on); Ignore: they are admitted unchecked and the operator's reconcile still refuses an
  # invalid or policy-violating spec, but the requester checks are skipped (docs/operator.md).
  failurePolicy: {{ $.Values.webhook.failurePolicy }}
  timeoutSeconds: {{ $.Values.webhook.timeoutSeconds }}
  matchPolicy: Equivalent
  {{- if eq $.Values.watch.mode "namespaced" }}
  namespaceSelector:
    matchExpressions:
      - key: kubernetes.io/metadata.name
        operator: In
        values:
          {{- toYaml (include "kubetitan.watchNamespaces" $ | fromJsonArray) | nindent 10 }}
  {{- end }}
  {{- if semverCompare ">=1.28-0" $.Capabilities.KubeVersion.Version }}
  # Only requests that create a run or change its spec reach the webhook: kopf's finalizer and annotation
  # patches, label edits and a finalizer removed by hand while no replica runs never depend on it (1.28+).
  matchConditions:
    - name: creates-or-changes-spec
      expression: "request.operation == 'CREATE' || object.spec != oldObject.spec"
  {{- end }}
  rules:
    - apiGroups: ["kubetitan.io"]
      apiVersions: ["v1alpha1"]
      resources: ["llamapretrains"]
      operations: ["CREATE", "UPDATE"]
      scope: Namespaced
  clientConfig:
    {{- if $.Values.webhook.url }}
    url: {{ printf "%s/validate-llamapretrain" $.Values.webhook.url | quote }}
    {{- else }}
    service:
      name: {{ $fullname }}-webhook
      namespace: {{ $.Release.Namespace }}
      path: /validate-llamapretrain
      port: 443
    {{- end }}
{{- end }}
