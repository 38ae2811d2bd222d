# Sourced by the router benchmarks: the one nginx configuration the router is compared against,
# a plain keep-alive reverse proxy with no buffering, so every benchmark measures the same nginx.
# write_nginx_conf DIR BACKEND_PORT LISTEN_PORT [EXTRA TOP-LEVEL DIRECTIVES]
write_nginx_conf() {
  local dir=$1 backend=$2 listen=$3 extra=${4:-}
  mkdir -p "$dir/nginx"
  cat >"$dir/nginx.conf" <<NGINX
worker_processes 1;
daemon off;
${extra}pid $dir/nginx.pid;
error_log $dir/nginx/error.log;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir/nginx/body; proxy_temp_path $dir/nginx/proxy;
  fastcgi_temp_path $dir/nginx/fcgi; uwsgi_temp_path $dir/nginx/uwsgi; scgi_temp_path $dir/nginx/scgi;
  # No request limit per connection on either side (nginx closes after 1000 by default; the
  # router never does, and open_loop.rs does not reconnect).
  upstream backend { server 127.0.0.1:$backend; keepalive 256; keepalive_requests 1000000000; }
  server {
    listen 127.0.0.1:$listen;
    keepalive_requests 1000000000;
    location / {
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
NGINX
}
