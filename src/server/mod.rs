pub mod callback;
