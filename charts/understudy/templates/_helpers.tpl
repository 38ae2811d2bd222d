{{- define "understudy.labels" -}}
app.kubernetes.io/name: understudy
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The labels that select one component's pods: (list $ "router"). */}}
{{- define "understudy.selector" -}}
app.kubernetes.io/name: understudy
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* A component's labels, selector included: (list $ "router"). */}}
{{- define "understudy.componentLabels" -}}
{{ include "understudy.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* A component's image: (list $ .Values.router.image). */}}
{{- define "understudy.image" -}}
{{ (index . 1).repository }}:{{ (index . 0).Values.image.tag | default (index . 0).Chart.AppVersion }}
{{- end }}

{{/* The routers' admin token Secret's name. */}}
{{- define "understudy.routerTokenSecret" -}}
{{ .Values.router.tokenSecret | default (printf "%s-router-token" .Release.Name) }}
{{- end }}

{{/* What every understudy container runs with: no root, nothing written to the image. */}}
{{- define "understudy.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: ["ALL"]}
{{- end }}
