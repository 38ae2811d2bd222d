{{- define "understudy.labels" -}}
app.kubernetes.io/name: understudy
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
{{- define "understudy.selector" -}}
app.kubernetes.io/name: understudy
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
