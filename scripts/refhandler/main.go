// Command refhandler is the yardstick of scripts/bench-orders.sh: the least a
// Go service can do for POST /api/orders — plain net/http and pgx, decode and
// check the body, write the order and its order.created outbox event in one
// statement, answer 201 with the stored order. No tracing, metrics, logging,
// middleware or delivery: the service is measured against this.
//
//	DATABASE_URL=postgres://… ADDR=127.0.0.1:18090 go run ./scripts/refhandler
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

type item struct {
	SKU        string `json:"sku"`
	Qty        int64  `json:"qty"`
	PriceCents int64  `json:"priceCents"`
}

type order struct {
	ID         int64     `json:"id"`
	Customer   string    `json:"customer"`
	Items      []item    `json:"items"`
	TotalCents int64     `json:"totalCents"`
	CreatedAt  time.Time `json:"createdAt"`
}

// insertOrder writes the order and its event in one statement (one round trip).
const insertOrder = `WITH o AS (
	INSERT INTO orders (customer, items, total_cents) VALUES ($1, $2, $3) RETURNING id, created_at
), e AS (
	INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
	SELECT 'order', o.id::text, 'order.created',
	       jsonb_build_object('id', o.id, 'customer', $1::text, 'items', $2::jsonb, 'totalCents', $3::bigint, 'createdAt', o.created_at)
	FROM o
)
SELECT id, created_at FROM o`

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	db, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return fmt.Errorf("connecting: %w", err)
	}
	defer db.Close()

	mux := http.NewServeMux()
	mux.HandleFunc("POST /api/orders", func(w http.ResponseWriter, r *http.Request) {
		var o order
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 64<<10)).Decode(&o); err != nil ||
			o.Customer == "" || len(o.Items) == 0 {
			http.Error(w, `{"error":{"code":"invalid_json","message":"bad order"}}`, http.StatusBadRequest)
			return
		}
		for _, it := range o.Items {
			o.TotalCents += it.Qty * it.PriceCents
		}
		items, _ := json.Marshal(o.Items)
		if err := db.QueryRow(r.Context(), insertOrder, o.Customer, items, o.TotalCents).Scan(&o.ID, &o.CreatedAt); err != nil {
			http.Error(w, `{"error":{"code":"internal","message":"insert failed"}}`, http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(o)
	})
	srv := &http.Server{Addr: os.Getenv("ADDR"), Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.ListenAndServe() }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return srv.Shutdown(shutdownCtx)
}
