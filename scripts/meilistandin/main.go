// Command meilistandin is a stand-in for Meilisearch in benchmarks: no
// Meilisearch server can be installed here (docker-compose runs the real
// one). It answers the calls the service makes — GET /health, POST /indexes,
// PUT /indexes/{uid}/settings/searchable-attributes, POST
// /indexes/{uid}/documents — after -latency, as a real server's round trip
// and enqueueing would take, and counts the documents it was given. It
// indexes nothing and searches nothing.
//
//	go run ./scripts/meilistandin -addr 127.0.0.1:17700 -latency 5ms
//	curl 127.0.0.1:17700/stats   # {"calls":N,"documents":M}
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:17700", "listen address")
	latency := flag.Duration("latency", 5*time.Millisecond, "how long each answer takes")
	flag.Parse()

	var calls, documents atomic.Int64
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"status":"available"}`)
	})
	mux.HandleFunc("GET /stats", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, `{"calls":%d,"documents":%d}`, calls.Load(), documents.Load())
	})
	enqueued := func(w http.ResponseWriter, uid string) {
		time.Sleep(*latency)
		calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusAccepted)
		fmt.Fprintf(w, `{"taskUid":1,"indexUid":%q,"status":"enqueued","type":"documentAdditionOrUpdate","enqueuedAt":%q}`,
			uid, time.Now().UTC().Format(time.RFC3339))
	}
	mux.HandleFunc("POST /indexes", func(w http.ResponseWriter, r *http.Request) { enqueued(w, "") })
	mux.HandleFunc("PUT /indexes/{uid}/settings/{setting}", func(w http.ResponseWriter, r *http.Request) {
		enqueued(w, r.PathValue("uid"))
	})
	mux.HandleFunc("POST /indexes/{uid}/documents", func(w http.ResponseWriter, r *http.Request) {
		var docs []json.RawMessage
		if err := json.NewDecoder(r.Body).Decode(&docs); err != nil {
			http.Error(w, `{"message":"documents must be a JSON array","code":"malformed_payload"}`, http.StatusBadRequest)
			return
		}
		documents.Add(int64(len(docs)))
		enqueued(w, r.PathValue("uid"))
	})
	srv := &http.Server{Addr: *addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout: 30 * time.Second, WriteTimeout: 30 * time.Second, IdleTimeout: time.Minute}
	log.Printf("Meilisearch stand-in on %s, %s an answer (it indexes nothing)", strings.TrimPrefix(*addr, "http://"), *latency)
	log.Fatal(srv.ListenAndServe())
}
